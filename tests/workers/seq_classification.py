"""`*ForSequenceClassification` models and TRL's RewardTrainer through MerakTrainer (the runs
of seq_classification_common.RUNS and REWARD_RUNS whose layout fits the launch): each returns
what it logged, evaluated and predicted, for test_sequence_classification to compare with
single-process HF Trainer / RewardTrainer."""

from __future__ import annotations

import os

import seq_classification_common as common
from common import out_dir, run_scenarios

import merak


def run(name: str) -> dict:
    family, num_labels, _, (dp, tp, pp) = common.RUNS[common.AVERAGED.get(name, name)]
    merak.init(dp=dp, tp=tp, pp=pp)
    with merak.init_empty_weights():
        model = common.model(family, num_labels)
    return common.train_and_evaluate(merak.MerakTrainer, merak.MerakArguments, name, model,
                                     output_dir=str(out_dir() / name))


def run_reward(name: str) -> dict:
    import trl
    from sft_common import merak_classes

    Config, MerakRewardTrainer = merak_classes(trl.RewardConfig, trl.RewardTrainer)
    (dp, tp, pp), fields, margins = common.REWARD_RUNS[name]
    merak.init(dp=dp, tp=tp, pp=pp)
    with merak.init_empty_weights():
        model = common.model("llama", 1)
    return common.train_reward(MerakRewardTrainer, Config, name, model,
                               output_dir=str(out_dir() / name))


def scenarios(world_size: int) -> dict:
    runs = {**common.RUNS, **{n: common.RUNS[base] for n, base in common.AVERAGED.items()}}
    plain = {name: (lambda name=name: run(name)) for name, (*_, layout) in runs.items()
             if common.world_size(layout) == world_size}
    reward = {name: (lambda name=name: run_reward(name))
              for name, (layout, *_) in common.REWARD_RUNS.items()
              if common.world_size(layout) == world_size}
    return {**plain, **reward}


if __name__ == "__main__":
    run_scenarios(scenarios(int(os.environ["WORLD_SIZE"])))
