"""`python -m nq` is the `nq` command."""
from nq.cli import main

raise SystemExit(main())
