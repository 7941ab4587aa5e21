"""Torch-free records the layers hand each other, below all of them: the run plan the
configuration builds and the ranks instantiate (:mod:`.runplan`), the timeline both the
simulator and the runtime write (:mod:`.timeline`) and its Chrome-trace file
(:mod:`.trace`). Nothing here imports a higher layer.
"""
