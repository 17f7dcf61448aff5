"""`python -m bench.gpu_check`: the package docstring says what it checks."""

from bench.gpu_check import main

raise SystemExit(main())
