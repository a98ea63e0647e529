"""`python -m tfscale.launch --num_workers=N [--backend=mwms|horovod] -- <python args...>` (tfscale.launch.launch)."""

from tfscale.launch.launch import run

if __name__ == "__main__":
    run()
