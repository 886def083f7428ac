"""``python -m jax_w4a4.budget``: the command line of :func:`jax_w4a4.budget.main`.

A package ``__main__`` rather than a module run as a script: ``jax_w4a4`` imports ``jax_w4a4.budget``, and
running that module with ``-m`` would execute it a second time (runpy warns about it).
"""

from jax_w4a4.budget import main

main()
