"""Scale-out: replicas of the API on a Ray Serve cluster, a front that keeps conversations on their replica, one view."""
