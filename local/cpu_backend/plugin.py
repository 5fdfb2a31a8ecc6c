"""Registering the CPU backend in a process: the module ``VERL_USE_EXTERNAL_MODULES`` names.

``import verl`` imports the modules listed in ``VERL_USE_EXTERNAL_MODULES`` in every process that imports verl,
Ray workers included. Importing this one imports ``platform`` (which registers the ``cpu`` platform and, only when
``VERL_PLATFORM=cpu``, installs its workarounds) and ``rollout`` (which registers ``hfcpu``); registration selects
nothing. Importing it twice changes nothing.

Why the work happens in those modules and not here: ``import verl`` runs this import from inside whichever module
of this package imported verl first (a Ray worker unpickling ``server.HFCpuServer`` starts with ``server``), so a
module may still be half-initialised when this runs. Each module therefore does its own registration when it
finishes, and modules of this package refer to each other as modules (``from . import platform``), never by name.
"""

from __future__ import annotations

from . import platform, rollout  # noqa: F401  (imported for their registrations)
