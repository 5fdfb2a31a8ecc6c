"""MiniWoB++ (the ``miniwob==1.1.0`` wheel, Farama, MIT) through the real ``interactive_browser`` server: the
wheel's own task pages served on 127.0.0.1 behind a thin adapter (:mod:`.pages`, :mod:`.site`), graded by nemo-gym's
own ``/verify`` on a completion code only MiniWoB's raw reward of 1 reveals (:mod:`.grading`), the tasks the five
browser tools can express and why the others are left out (:mod:`.inventory`), their rows (:mod:`.suite`) and a
scripted solver that reads only observations (:mod:`.solver`). Install with the ``miniwob`` extra."""
