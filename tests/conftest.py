import os
import sys

# Make `import support` work from any test module.
sys.path.insert(0, os.path.dirname(__file__))
