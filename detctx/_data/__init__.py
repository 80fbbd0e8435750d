"""Data loading: loader generators and worker seeds, each worker's RNG streams carried in its
state, ``resumable_loader`` / ``resume_state`` / ``resume``, keyed collation, and the elastic
loader (samples keyed by index, a position that is one number).
"""

from __future__ import annotations

from detctx._data.dcp_state import DCPResumeState, dcp_resume_state
from detctx._data.elastic import ElasticLoader, elastic_loader
from detctx._data.keyed_collate import KEYED_STREAMS_VERSION, KeyedCollate
from detctx._data.loader import loader_generator, seed_worker
from detctx._data.resuming import resumable_loader, resume, resume_state

__all__ = [
    "KEYED_STREAMS_VERSION",
    "DCPResumeState",
    "ElasticLoader",
    "KeyedCollate",
    "dcp_resume_state",
    "elastic_loader",
    "loader_generator",
    "resumable_loader",
    "resume",
    "resume_state",
    "seed_worker",
]
