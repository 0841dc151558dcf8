"""The strategy search's pure half: model shapes, costs, cluster descriptions, prediction and
search (`merak plan`); the half that runs dry runs is `merak.dryrun`."""

from merak.strategy.candidate import Candidate, Prediction
from merak.strategy.cluster import CLUSTERS, Cluster, cluster
from merak.strategy.predict import Predictor
from merak.strategy.search import StrategyPlan, read_strategy_plan, search
from merak.strategy.shape import ModelShape

__all__ = ["CLUSTERS", "Candidate", "Cluster", "ModelShape", "Prediction", "Predictor",
           "StrategyPlan", "cluster", "read_strategy_plan", "search"]
