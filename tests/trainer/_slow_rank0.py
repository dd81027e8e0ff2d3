"""opid-train with global rank 0's rollout and evaluation delayed by OPID_TEST_DELAY_S seconds (fault injection for
test_control_channel: rank 0 slower than the training groups' timeout)."""
import os
import sys
import time

from opid_mega import trainer

_play = trainer.play


def slow_play(*args, **kwargs):
    time.sleep(float(os.environ["OPID_TEST_DELAY_S"]))
    return _play(*args, **kwargs)


trainer.play = slow_play

if __name__ == "__main__":
    from opid_mega.cli import train_main

    sys.exit(train_main(sys.argv[1:]))
