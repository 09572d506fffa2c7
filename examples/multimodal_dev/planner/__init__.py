"""The layout planner: predicting the memory of each rank and the time of a step for launch
layouts (TP, CP, PP, VP, EP, ETP, recompute) and choosing one (``layout_plan``, ``layout_cost``),
the pipeline splits it and the run's checks use (``pipeline_layout``), and the meta-device builds
its counts are held to (``meta_builds``, ``mapping_coverage``). Planning imports no torch, so
``tools/plan_layout.py`` and the run script's DRY_RUN start quickly."""
