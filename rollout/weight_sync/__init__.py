"""Weight sync: update groups, tensor handoff, disk reload, versions, memory release/resume."""
