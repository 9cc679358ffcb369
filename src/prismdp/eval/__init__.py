"""Evaluation helpers: GLUE metrics (:mod:`.metrics`) and answer extraction from generations (:mod:`.answers`)."""
