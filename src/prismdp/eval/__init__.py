"""Evaluation: GLUE metrics (:mod:`.metrics`), answer extraction from generations (:mod:`.answers`), and the
generation-based evaluation of causal LMs by job: the test sets (:mod:`.sets`), greedy decoding (:mod:`.decoding`),
scoring (:mod:`.scoring`) and the run over all sets (:mod:`.generation`).  Task facts come from
:mod:`prismdp.data.tasks`; ``eval`` depends on ``data``, never the reverse."""
