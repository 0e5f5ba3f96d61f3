"""placeholder"""
def recipe(): return {"recipe": "smollm2-v1"}
def build_smollm2_135m_instruct(out_dir): raise NotImplementedError
