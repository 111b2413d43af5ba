"""SLO planner: pool profiles, load predictors, replica sizing, the planning loop, and a
virtual-time simulator that replays load traces against profiled replicas."""
