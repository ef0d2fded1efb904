"""The planner's shared words: its constants and errors, the target a plan is made for and the Plan itself."""
