import sys

from neuron_async_sm.cli import main

sys.exit(main())
