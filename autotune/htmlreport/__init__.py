"""The HTML report of a study: one self-contained file a team lead reads in two minutes, the answer first.

:func:`build_report` turns an open study into the page (:mod:`.page`), from the trials' records
(:mod:`.data`), signed parameter importances (:mod:`.importance`) and inline SVG charts (:mod:`.svg`).
"""

from autotune.htmlreport.page import build_report

__all__ = ["build_report"]
