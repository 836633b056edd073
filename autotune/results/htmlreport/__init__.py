"""The HTML report of a study: one self-contained file a team lead reads in two minutes, the answer first.

:func:`build_report` turns an open study into the page (:mod:`.page`), from the trials' records
(:mod:`.data`), signed parameter importances (:mod:`.importance`) and inline SVG charts (:mod:`.svg`).
What the sections share is read once (:mod:`.context`); each section is drawn by its own module: the
answer (:mod:`.answer`), the study's charts (:mod:`.charts`), the latency distributions (:mod:`.latency`),
the rate searches and all trials (:mod:`.tables`), the run's facts and method (:mod:`.facts`).
"""

from autotune.results.htmlreport.page import build_report

__all__ = ["build_report"]
