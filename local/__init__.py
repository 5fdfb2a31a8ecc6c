"""Running the recipe for real on one machine without a GPU: the CPU backend for verl, the Corner Shop site and its
tasks, the in-process environment server, the fault proxy and its rules, the scripted policy, the tiny policy and
its chat tokenizer, and ``training_run`` (verl's ``main_ppo`` with this recipe, on CPU)."""
