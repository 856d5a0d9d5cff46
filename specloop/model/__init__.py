"""The looped model: stages (embed / loop / head) and the dense reference (the oracle)."""

from specloop.model.ouro import OuroModel
from specloop.model.reference import ReferenceOutput, reference_forward, reference_greedy

__all__ = ["OuroModel", "ReferenceOutput", "reference_forward", "reference_greedy"]
