import os
import sys

# tests import the zoo and helpers as plain modules, also inside spawned ranks
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
