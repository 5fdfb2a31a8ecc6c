"""verl plugin entry point: importing this module installs the recipe's lazy trainer wiring.

verl's ``import verl`` *loads* every ``verl.plugins`` entry point (``EntryPoint.load()``: import the module, fetch
the attribute) and never calls what it gets, swallowing any error at debug level. The entry point therefore names
this module, ``nemo_gym_browser = "nemo_gym_browser.plugin"``, and the work happens at import: it adds the import
hook of ``patches.install_on_import`` (nothing heavy is imported, and verl's trainer modules are patched when they
are imported). ``NEMO_GYM_BROWSER_PATCHES=0`` or verl's ``VERL_USE_EXTERNAL_PLUGINS=none`` turn the wiring off;
the installed package stays importable either way.
"""

from __future__ import annotations

from .patches import install_on_import

INSTALLED = install_on_import()
