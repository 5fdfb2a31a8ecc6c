"""verl recipe: step-wise GRPO on NeMo Gym's ``interactive_browser`` environment.

The repository root is both the recipe folder and the ``nemo_gym_browser`` package. Importing the
package is cheap: no torch, verl or aiohttp import happens here.
"""

__version__ = "0.1.0"
