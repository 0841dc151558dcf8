"""Automatic parallel strategy: measure or describe, predict, search, dry-run (`merak plan`)."""

from merak.plan.cluster import CLUSTERS, Cluster, cluster
from merak.plan.predict import Candidate, Prediction, Predictor
from merak.plan.search import Plan, read_plan, search
from merak.plan.shape import ModelShape

__all__ = ["CLUSTERS", "Candidate", "Cluster", "ModelShape", "Plan", "Prediction", "Predictor",
           "cluster", "read_plan", "search"]
