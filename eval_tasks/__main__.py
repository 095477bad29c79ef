"""`python -m eval_tasks ...` = `hf-loopcache-eval ...` (lm-eval's command line with the hf-loopcache model)."""

import sys

from eval_tasks.launcher import main

sys.exit(main())
