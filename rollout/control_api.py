"""ControlAPI: the weight, version, pause and memory methods that RolloutEngine and
RolloutClient share. Each takes its call's fields (rollout/weight_sync/calls.py), builds the
call, which checks them, and runs it through `control`: in the engine's scheduler, or on the
server's route of the same name.

Each returns the scheduler's {"success": True, "message": ..., ...}; bad arguments, or an
update that doesn't fit the model, raise TypeError/ValueError, a file outside allowed_roots
PermissionError, a failed transfer WeightSyncError (rollout/errors.py); a failed update leaves
the previous weights and version serving.
"""

from __future__ import annotations

from typing import Any

from rollout.control import ControlCall, control_method
from rollout.engine.lora_calls import LoadLoraAdapter, UnloadLoraAdapter
from rollout.weight_sync import calls


class ControlAPI:
    def control(self, call: ControlCall) -> Any:
        """Runs `call`: its result, or its failure raised as the exception of its kind."""
        raise NotImplementedError

    init_weights_update_group = control_method(calls.InitWeightsUpdateGroup)
    destroy_weights_update_group = control_method(calls.DestroyWeightsUpdateGroup)
    # Blocks until every tensor is received: the trainer broadcasts from another thread.
    update_weights_from_distributed = control_method(calls.UpdateWeightsFromDistributed)
    update_weight_version = control_method(calls.UpdateWeightVersion)
    pause_generation = control_method(calls.PauseGeneration)
    continue_generation = control_method(calls.ContinueGeneration)
    discard_staged_weights = control_method(calls.DiscardStagedWeights)
    release_memory_occupation = control_method(calls.ReleaseMemoryOccupation)
    resume_memory_occupation = control_method(calls.ResumeMemoryOccupation)
    load_lora_adapter = control_method(LoadLoraAdapter)
    unload_lora_adapter = control_method(UnloadLoraAdapter)
