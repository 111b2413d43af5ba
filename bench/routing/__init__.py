"""The routing policies on one cluster: TTFT, prompt tokens computed, the fast lane's share."""
