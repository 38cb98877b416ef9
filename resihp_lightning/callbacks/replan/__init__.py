"""Re-planning: the controller's decisions (:mod:`.replan_policy`, torch-free), the Lightning callback
(:class:`~.replan_controller.ReplanController`) and the planner in a worker process (:mod:`.background_planner`)."""
