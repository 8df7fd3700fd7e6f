"""Scale-out on Ray (`vidar cluster ...`): one EngineActor per GPU, a controller actor holding the
desired state, placement by measured slack, fencing and re-placement, one results endpoint (proxy).
Imported only by the cluster commands: single-node `vidar run` never imports Ray."""
