"""The mode-free core: change trackers, the Proxier and its SyncRunner, frontend claims, the
Datapath interface every datapath implements, and the event hub. Imports usproxy.model and
usproxy.util; knows datapaths only through usproxy.core.datapath."""
