"""opid-train with global rank 0's rollout and evaluation delayed by OPID_TEST_DELAY_S seconds (fault injection for
test_control_channel: rank 0 slower than the training groups' timeout; test_node_lost: a rank stopped while rank 0
plays, OPID_TEST_MARK naming a file rank 0 appends a line to when a rollout starts); OPID_TEST_DELAY_SKIP: that many
first rollouts are not delayed. OPID_TEST_TRAIN_DELAY_S: rank 0's PPO update starts that much later (the other
ranks wait in its collectives meanwhile), OPID_TEST_TRAIN_MARK naming a file rank 0 writes when the delay starts."""
import os
import sys
import time

from opid_mega import pipeline

_play = pipeline.play


_calls = [0]


def slow_play(*args, **kwargs):
    mark = os.environ.get("OPID_TEST_MARK")  # the test learns that rank 0's rollout has started
    if mark:
        with open(mark, "a") as f:
            f.write(f"{time.time()}\n")
    _calls[0] += 1
    if _calls[0] > int(os.environ.get("OPID_TEST_DELAY_SKIP", "0")):
        time.sleep(float(os.environ["OPID_TEST_DELAY_S"]))
    return _play(*args, **kwargs)


pipeline.play = slow_play  # the rollout stage looks play up in its module at call time

if os.environ.get("OPID_TEST_TRAIN_DELAY_S"):
    import torch.distributed as dist

    from opid_mega.megatron.policy import Policy

    _train = Policy.train

    def slow_train(self, data, seed):
        if dist.get_rank() == 0:
            with open(os.environ["OPID_TEST_TRAIN_MARK"], "a") as f:
                f.write(f"{time.time()}\n")
            time.sleep(float(os.environ["OPID_TEST_TRAIN_DELAY_S"]))
        return _train(self, data, seed)

    Policy.train = slow_train

if __name__ == "__main__":
    from opid_mega.cli import train_main

    sys.exit(train_main(sys.argv[1:]))
