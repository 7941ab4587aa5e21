"""Compare runs side by side: pipeflow-compare reads run and multirun directories
(training and simulation) and writes one report; see :mod:`pipeflow.compare.cli`."""
