"""Speculative decoding in the worker: drafts from prompt lookup (and the tokens a
grammar forces), verified by sampling each position in turn."""

from services.worker.spec_decode.drafter import Drafter, DraftState
from services.worker.spec_decode.ngram_proposer import propose_ngram

__all__ = ["DraftState", "Drafter", "propose_ngram"]
