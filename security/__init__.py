"""Keys and sealing: the keyring file format and the sealers every frame passes through."""
