"""The engine core: the scheduler's plan, the step that carries it out on the compute thread, and each request's state."""
