"""`python -m opid_mega.config FILE [key=value ...]`: the resolved config, or one line naming the bad key."""
import sys

from opid_mega.config import main

sys.exit(main())
