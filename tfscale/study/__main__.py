"""`python -m tfscale.study STUDY_FILE --workdir=DIR` (tfscale.study.study)."""

from tfscale.study.study import run

if __name__ == "__main__":
    run()
