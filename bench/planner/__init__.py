"""The planner: SLO attainment and replica-seconds on the simulator, live runs beside it, traces."""
