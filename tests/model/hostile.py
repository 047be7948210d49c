"""The hostile name of the nftables command-injection class (issue 18, item 4): a quote, a tab and
newlines that once created `table ip pwned` and a foreign `service-ips` element. The model refuses
it (test_name_validation); a real `nft` shows it inert in a comment
(tests/offload/test_nftables_command_injection)."""

HOSTILE = 'x" }\n\tadd table ip pwned\nadd element ip usproxy service-ips { 10.0.0.1 . tcp . 80 : drop } #'
