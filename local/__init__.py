"""Running the recipe for real on one machine without a GPU: the CPU backend for verl, the Corner Shop site and its
tasks, the warm-started tiny policy, and ``training_run`` (verl's ``main_ppo`` with this recipe, on CPU)."""
