"""What NVML's clock-event reasons mean for a training run: shared by the telemetry sampler (callbacks/) and the run
report's charts (report/), below both."""

# Reasons that mean the clocks are held back by heat or by a hardware signal: throttling.
THROTTLE_REASONS = frozenset({"HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"})
# The board keeping itself within its power limit. Under full load that is how a GPU is meant to run (boost
# clocks trade against power), so it is reported as "at power limit", not as throttling.
POWER_CAP_REASON = "SwPowerCap"
