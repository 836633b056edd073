"""What the user gives: the study spec, the search space bound to it, the SLO grammar, and the loaded study
(spec, space and paths, cross-checked)."""
