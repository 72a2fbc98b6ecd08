import sys

from services.target.worker import main

sys.exit(main())
