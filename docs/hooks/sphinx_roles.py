"""Griffe extension for the documentation site: render the docstrings' Sphinx roles as code.

prismdp's docstrings name other objects with Sphinx roles (:func:`~prismdp.lora.move_to_rank_r_start`,
:mod:`.statistics`); mkdocstrings does not read roles, so they would show as literal ``:func:`` text. Each role
becomes a code span of the name it points to (``~`` keeps the last component, as Sphinx shows it).
"""

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|obj|data|exc|const):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
