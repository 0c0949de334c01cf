import os

# Inductor's parallel compile workers would compete with the ranks for this machine's 2 cores
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
