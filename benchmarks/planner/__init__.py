"""What the planner and the GPU cost model predict: the planner's error against the step runs
(validate_plan), its projection to H100 clusters (project_plan), a recorded step replayed on a
modelled 8 x H100 node (project_gpu_step). The projections are modelled, not measured."""
