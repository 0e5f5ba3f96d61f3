"""The fleet's manager (driver-side facade) and controller (control-plane actor)."""

from rollfleet.manager.controller import FleetController, FleetControllerActor
from rollfleet.manager.llm_server_manager import LLMServerManager

__all__ = ["LLMServerManager", "FleetController", "FleetControllerActor"]
