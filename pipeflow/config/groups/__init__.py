"""The config by concern: one module per config group (and per top-level key with rules of
its own), each with the group's typed dataclass, its closed value sets and its checks;
:mod:`pipeflow.config.schema` composes the apps' schemas from them, :mod:`pipeflow.config.prepare`
runs the checks."""
