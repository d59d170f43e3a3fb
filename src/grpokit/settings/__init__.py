"""The configuration's tree of sections and fields (schema.py): plain typed values, importing
nothing of grpokit, so that every layer can take the section it reads (`RolloutConfig`,
`DataConfig`, ...). Reading, settling and checking a config is config/'s."""
