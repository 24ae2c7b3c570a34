"""`python -m pdctl.config --example`: pdctl.toml.example from the schema."""

import sys

from pdctl.config.example import main

sys.exit(main())
