"""`python -m hf_loopcache ...` is `hf-loopcache ...`."""

import sys

from hf_loopcache.cli import main

sys.exit(main())
