"""The wiring: the `usproxy` command line (cli), the agent that connects a source, the Proxier,
its datapaths and the admin server (agent), `usproxy check` (capabilities) and `--cleanup`
(cleanup). Nothing in the model, the sources or the datapaths imports from here."""
